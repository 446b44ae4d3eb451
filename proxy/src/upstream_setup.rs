//! What building the providers' clients can fail on ([`UpstreamError`]),
//! and their keys from the environment ([`provider_api_key`]).

use canarygate_policies::config::ProviderConfig;

/// Why the providers' clients could not be built.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// `extra_ca_file` is unreadable, not PEM, or empty.
    #[error("provider `{provider}`: extra_ca_file {path} {problem}")]
    ExtraCa {
        /// The provider.
        provider: String,
        /// The file.
        path: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `base_url` does not give a valid endpoint URL.
    #[error("provider `{provider}`: base_url gives `{url}`: {problem}")]
    BaseUrl {
        /// The provider.
        provider: String,
        /// The URL it gives.
        url: String,
        /// Why it is not valid.
        problem: String,
    },
    /// The environment variable that holds the provider's API key is unset
    /// or not header text.
    #[error("provider `{provider}`: environment variable {variable} {problem}")]
    ApiKey {
        /// The provider.
        provider: String,
        /// The variable.
        variable: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// `tokenizer_file` cannot be loaded.
    #[error("provider `{provider}`: cannot load tokenizer_file {path}: {problem}")]
    Tokenizer {
        /// The provider.
        provider: String,
        /// The file.
        path: String,
        /// Why.
        problem: String,
    },
    /// The HTTP client could not be built.
    #[error("provider `{provider}`: {problem}")]
    Client {
        /// The provider.
        provider: String,
        /// Why.
        problem: String,
    },
    /// No provider of that name in the policy.
    #[error("the policy has no provider `{0}`")]
    NoSuchProvider(String),
}

/// The provider's API key from the environment: `variable` when given,
/// else the provider's `api_key_env`. `Ok(None)` when neither names one.
pub fn provider_api_key(
    provider: &ProviderConfig,
    variable: Option<&str>,
) -> Result<Option<String>, UpstreamError> {
    let Some(variable) = variable.or(provider.api_key_env.as_deref()) else {
        return Ok(None);
    };
    std::env::var(variable)
        .map(Some)
        .map_err(|_| UpstreamError::ApiKey {
            provider: provider.name.get_ref().clone(),
            variable: variable.to_owned(),
            problem: "is not set",
        })
}
