//! HTTP(S) clients for the policy's providers.

use std::time::Duration;

use axum::http::HeaderValue;
use canarygate_policies::config::{AuthMode, Policy, ProviderConfig};

use crate::error::{ApiError, error_chain};
use crate::identity::bearer;

/// One provider: its client (own connection pool and trust roots) and key.
pub struct Upstream {
    /// Provider name from the policy.
    pub name: String,
    /// Parsed once: parsing a URL per request is measurable in a profile.
    chat_completions_url: reqwest::Url,
    client: reqwest::Client,
    /// Provider key from `api_key_env`, attached in managed auth.
    managed_key: Option<HeaderValue>,
    /// The provider's tokenizer (`tokenizer_file`), for exact prompt counts.
    tokenizer: Option<tokenizers::Tokenizer>,
}

/// Builds one [`Upstream`] per provider of `policy`, in policy order.
pub fn build_upstreams(policy: &Policy) -> Result<Vec<Upstream>, String> {
    policy
        .providers
        .iter()
        .map(|provider| Upstream::new(provider, policy))
        .collect()
}

impl Upstream {
    fn new(provider: &ProviderConfig, policy: &Policy) -> Result<Self, String> {
        let name = provider.name.get_ref().clone();
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .connect_timeout(Duration::from_millis(policy.limits.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            // Never retried by the client (a retry is a policy decision); also spares
            // reqwest cloning every request in case it retries.
            .retry(reqwest::retry::never())
            .no_proxy();
        if let Some(path) = &provider.extra_ca_file {
            let pem = std::fs::read(path).map_err(|error| {
                format!("provider `{name}`: cannot read extra_ca_file {path}: {error}")
            })?;
            let certificates = reqwest::Certificate::from_pem_bundle(&pem).map_err(|error| {
                format!("provider `{name}`: extra_ca_file {path} is not PEM: {error}")
            })?;
            if certificates.is_empty() {
                return Err(format!(
                    "provider `{name}`: extra_ca_file {path} holds no certificate"
                ));
            }
            for certificate in certificates {
                builder = builder.add_root_certificate(certificate);
            }
        }
        let url = format!(
            "{}/chat/completions",
            provider.base_url.get_ref().trim_end_matches('/')
        );
        let chat_completions_url = reqwest::Url::parse(&url)
            .map_err(|error| format!("provider `{name}`: base_url gives `{url}`: {error}"))?;
        let client = builder
            .build()
            .map_err(|error| format!("provider `{name}`: {}", error_chain(&error)))?;
        let managed_key = match (policy.auth.mode, &provider.api_key_env) {
            (AuthMode::Managed, Some(variable)) => {
                let key = std::env::var(variable).map_err(|_| {
                    format!(
                        "provider `{name}`: auth is managed but environment variable {variable} \
                         (api_key_env) is not set"
                    )
                })?;
                Some(bearer(&key).map_err(|_| {
                    format!("provider `{name}`: {variable} is not valid header text")
                })?)
            }
            _ => None,
        };
        let tokenizer = match &provider.tokenizer_file {
            Some(path) => Some(tokenizers::Tokenizer::from_file(path).map_err(|error| {
                format!("provider `{name}`: cannot load tokenizer_file {path}: {error}")
            })?),
            None => None,
        };
        Ok(Self {
            tokenizer,
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

    /// The provider's key for managed auth, if configured.
    pub fn managed_key(&self) -> Option<&HeaderValue> {
        self.managed_key.as_ref()
    }

    /// Whether the provider answers HTTP at all (any status counts), within 5 s.
    pub async fn check_reachable(&self) -> Result<(), String> {
        let mut url = self.chat_completions_url.clone();
        url.set_path(&url.path().replace("/chat/completions", "/models"));
        self.client
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map(drop)
            .map_err(|error| error_chain(&error))
    }

    /// A POST to the provider's `/chat/completions`.
    pub fn chat_completions(&self) -> reqwest::RequestBuilder {
        self.client.post(self.chat_completions_url.clone())
    }
}

/// Maps a failed upstream send to the client-facing error (502 or 504).
pub fn send_error(provider: &str, error: &reqwest::Error) -> ApiError {
    let detail = error_chain(error);
    if error.is_timeout() {
        ApiError::gateway_timeout(format!(
            "Provider `{provider}` did not accept the connection in time: {detail}"
        ))
    } else if error.is_connect() && detail.contains("certificate") {
        ApiError::bad_gateway(
            "upstream_tls_error",
            format!(
                "TLS with provider `{provider}` failed: {detail}. For a private CA, set the \
                 provider's extra_ca_file."
            ),
        )
    } else if error.is_connect() {
        ApiError::bad_gateway(
            "upstream_unreachable",
            format!("Provider `{provider}` is unreachable: {detail}"),
        )
    } else {
        ApiError::bad_gateway(
            "upstream_error",
            format!("Request to provider `{provider}` failed: {detail}"),
        )
    }
}
