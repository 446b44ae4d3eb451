//! Every error canarygate itself answers with: one [`ErrorCode`] per
//! situation, mapped to its HTTP status, error type and code in one place
//! ([`ErrorCode::status`], [`ErrorCode::kind`], [`ErrorCode::code`]).
//!
//! Code decides on variants, never on the wire strings. How an error is
//! written on the wire is the wire format's business
//! (`WireFormat::error_body`, in `wire`); the README's error table lists
//! every code (a test holds it to [`ErrorCode::ALL`]).

use axum::http::StatusCode;
use canarygate_policies::config::ProviderApi;
use canarygate_policies::verify::Verdict;

/// What went wrong, as canarygate tells the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The body is not JSON, or not a JSON object.
    InvalidJson,
    /// A field has the wrong type or value (the error names it in `param`).
    InvalidValue,
    /// The body could not be read from the connection.
    InvalidBody,
    /// `x-canarygate-session` is not ASCII text (visible characters, spaces
    /// and tabs) of at most 128 bytes.
    InvalidSessionHeader,
    /// Prompt plus `max_tokens` exceed the context canarygate may send (the
    /// provider's trusted limit, or what the local engine serves).
    ContextLengthExceeded,
    /// No `Authorization: Bearer` header.
    MissingApiKey,
    /// A malformed `Authorization` header, or (managed auth) an unknown key.
    InvalidApiKey,
    /// No route of the policy matches the model.
    ModelNotFound,
    /// No such endpoint.
    UnknownUrl,
    /// An endpoint whose answers cannot be verified (embeddings, a
    /// passthrough path) under `[endpoints] unverifiable = "block"`.
    UnverifiableEndpoint,
    /// The endpoint exists but not with this method (sent with `Allow`).
    MethodNotAllowed,
    /// The request body did not arrive within `limits.client_body_timeout_ms`,
    /// or stalled longer than `limits.client_body_idle_timeout_ms`.
    RequestTimeout,
    /// The body is over `limits.max_body_bytes`.
    RequestTooLarge,
    /// The body came with a `Content-Encoding` other than `identity`
    /// (canarygate reads bodies as sent, not compressed).
    UnsupportedContentEncoding,
    /// `limits.max_concurrent_requests` are in flight.
    TooManyConcurrentRequests,
    /// The provider refused the connection or could not be resolved.
    UpstreamUnreachable,
    /// TLS with the provider failed (untrusted certificate).
    UpstreamTlsError,
    /// The provider failed while answering.
    UpstreamError,
    /// The provider answered with a body that is not JSON.
    UpstreamInvalidJson,
    /// The provider's answer is over the size canarygate reads.
    UpstreamResponseTooLarge,
    /// The provider's stream broke off, stalled or closed early.
    UpstreamStreamInterrupted,
    /// The provider answered an error that is not in the client's format:
    /// wrapped, with the provider's own HTTP status.
    UpstreamHttpError,
    /// Connect or first-byte timeout, or a whole answer that stalled.
    UpstreamTimeout,
    /// The answer failed verification and the policy withholds it.
    VerificationFailed,
    /// The request should be served locally but no `[local]` engine runs.
    LocalEngineUnavailable,
    /// The local engine refused the request as malformed.
    LocalEngineRejected,
    /// The local engine is shutting down.
    LocalEngineStopping,
    /// The local engine failed while generating.
    LocalEngineFailed,
    /// The audit record could not be made durable, so the answer is withheld.
    AuditLogUnavailable,
    /// The shared canary registry cannot be reached and the policy fails
    /// closed: nothing was sent upstream.
    RegistryUnavailable,
    /// canarygate itself failed.
    InternalError,
}

impl ErrorCode {
    /// Every code, in the README table's order.
    pub const ALL: [Self; 31] = [
        Self::InvalidJson,
        Self::InvalidValue,
        Self::InvalidBody,
        Self::InvalidSessionHeader,
        Self::ContextLengthExceeded,
        Self::LocalEngineRejected,
        Self::MissingApiKey,
        Self::InvalidApiKey,
        Self::ModelNotFound,
        Self::UnknownUrl,
        Self::UnverifiableEndpoint,
        Self::MethodNotAllowed,
        Self::RequestTimeout,
        Self::RequestTooLarge,
        Self::UnsupportedContentEncoding,
        Self::TooManyConcurrentRequests,
        Self::UpstreamUnreachable,
        Self::UpstreamTlsError,
        Self::UpstreamError,
        Self::UpstreamInvalidJson,
        Self::UpstreamResponseTooLarge,
        Self::UpstreamStreamInterrupted,
        Self::UpstreamHttpError,
        Self::VerificationFailed,
        Self::LocalEngineUnavailable,
        Self::UpstreamTimeout,
        Self::AuditLogUnavailable,
        Self::RegistryUnavailable,
        Self::LocalEngineFailed,
        Self::InternalError,
        Self::LocalEngineStopping,
    ];

    /// The `code` on the wire.
    pub fn code(self) -> &'static str {
        match self {
            Self::InvalidJson => "invalid_json",
            Self::InvalidValue => "invalid_value",
            Self::InvalidBody => "invalid_body",
            Self::InvalidSessionHeader => "invalid_session_header",
            Self::ContextLengthExceeded => "context_length_exceeded",
            Self::MissingApiKey => "missing_api_key",
            Self::InvalidApiKey => "invalid_api_key",
            Self::ModelNotFound => "model_not_found",
            Self::UnknownUrl => "unknown_url",
            Self::UnverifiableEndpoint => "canarygate_unverifiable_endpoint",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::RequestTimeout => "request_timeout",
            Self::RequestTooLarge => "request_too_large",
            Self::UnsupportedContentEncoding => "unsupported_content_encoding",
            Self::TooManyConcurrentRequests => "too_many_concurrent_requests",
            Self::UpstreamUnreachable => "upstream_unreachable",
            Self::UpstreamTlsError => "upstream_tls_error",
            Self::UpstreamError => "upstream_error",
            Self::UpstreamInvalidJson => "upstream_invalid_json",
            Self::UpstreamResponseTooLarge => "upstream_response_too_large",
            Self::UpstreamStreamInterrupted => "upstream_stream_interrupted",
            Self::UpstreamHttpError => "upstream_http_error",
            Self::UpstreamTimeout => "upstream_timeout",
            Self::VerificationFailed => "canarygate_verification_failed",
            Self::LocalEngineUnavailable => "local_engine_unavailable",
            Self::LocalEngineRejected => "local_engine_error",
            Self::LocalEngineStopping => "engine_unavailable",
            Self::LocalEngineFailed => "engine_error",
            Self::AuditLogUnavailable => "audit_log_unavailable",
            Self::RegistryUnavailable => "canarygate_registry_unavailable",
            Self::InternalError => "internal_error",
        }
    }

    /// The HTTP status. [`ErrorCode::UpstreamHttpError`] answers with the
    /// provider's own status instead ([`ApiError::provider_http`]).
    pub fn status(self) -> StatusCode {
        match self {
            Self::InvalidJson
            | Self::InvalidValue
            | Self::InvalidBody
            | Self::InvalidSessionHeader
            | Self::ContextLengthExceeded
            | Self::LocalEngineRejected => StatusCode::BAD_REQUEST,
            Self::MissingApiKey | Self::InvalidApiKey => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound | Self::UnknownUrl => StatusCode::NOT_FOUND,
            Self::UnverifiableEndpoint => StatusCode::FORBIDDEN,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedContentEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::TooManyConcurrentRequests => StatusCode::TOO_MANY_REQUESTS,
            Self::UpstreamUnreachable
            | Self::UpstreamTlsError
            | Self::UpstreamError
            | Self::UpstreamInvalidJson
            | Self::UpstreamResponseTooLarge
            | Self::UpstreamStreamInterrupted
            | Self::UpstreamHttpError
            | Self::VerificationFailed
            | Self::LocalEngineUnavailable => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Self::LocalEngineStopping | Self::RegistryUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::AuditLogUnavailable | Self::LocalEngineFailed | Self::InternalError => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// OpenAI's error `type`.
    pub fn kind(self) -> &'static str {
        match self.status() {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            _ if self == Self::VerificationFailed => "canarygate_verification_failed",
            status if status.is_client_error() => "invalid_request_error",
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => "upstream_error",
            _ => "server_error",
        }
    }

    /// Whether the provider could not serve at all (unreachable, no first
    /// byte in time, failed before answering): with
    /// `local.on_upstream_unavailable` the local engine serves instead.
    pub fn provider_unavailable(self) -> bool {
        matches!(
            self,
            Self::UpstreamUnreachable | Self::UpstreamTimeout | Self::UpstreamError
        )
    }
}

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// What went wrong.
    pub code: ErrorCode,
    /// Human-readable explanation.
    pub message: String,
    /// The request field at fault, if any.
    pub param: Option<&'static str>,
    /// Names of the failed checks ([`ErrorCode::VerificationFailed`] only).
    pub failed_checks: Vec<&'static str>,
    status: StatusCode,
}

impl ApiError {
    /// `code` with `message`, at the code's status.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            param: None,
            failed_checks: Vec::new(),
            status: code.status(),
        }
    }

    /// The same error about request field `param`.
    pub fn with_param(self, param: &'static str) -> Self {
        Self {
            param: Some(param),
            ..self
        }
    }

    /// 400 `invalid_value` about field `param`.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidValue, message).with_param(param)
    }

    /// 400 `local_engine_error`: the local engine cannot serve `what`,
    /// which field `param` asks for.
    pub fn local_engine_cannot_serve(param: &'static str, what: impl std::fmt::Display) -> Self {
        Self::new(
            ErrorCode::LocalEngineRejected,
            format!("Local engine: cannot serve {what}"),
        )
        .with_param(param)
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            ErrorCode::ModelNotFound,
            format!("The model `{model}` is not routed by this canarygate policy."),
        )
        .with_param("model")
    }

    /// 404 `model_not_found`: `model` is routed, but to a provider of
    /// another API than the endpoint called.
    pub fn model_on_other_api(model: &str, api: ProviderApi) -> Self {
        let endpoint = match api {
            ProviderApi::Openai => {
                "OpenAI's endpoints (/v1/chat/completions, /v1/responses, /v1/completions)"
            }
            ProviderApi::Anthropic => "Anthropic's Messages endpoint (POST /v1/messages)",
        };
        Self::new(
            ErrorCode::ModelNotFound,
            format!(
                "The model `{model}` is routed to a provider of api \"{}\": call it through \
                 {endpoint}.",
                api.name()
            ),
        )
        .with_param("model")
    }

    /// 413 `request_too_large`.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            ErrorCode::RequestTooLarge,
            format!("Request body exceeds the limit of {limit} bytes (limits.max_body_bytes)."),
        )
    }

    /// 413 `request_too_large`: the body would take `bound` bytes parsed,
    /// over `limits.max_parsed_bytes` (`budget`).
    pub fn too_large_parsed(bound: u64, budget: u64) -> Self {
        Self::new(
            ErrorCode::RequestTooLarge,
            format!(
                "Request body would take up to {bound} bytes once parsed (its JSON values \
                 count, not only its size), over the limit of {budget} \
                 (limits.max_parsed_bytes)."
            ),
        )
    }

    /// 429 `too_many_concurrent_requests`: the request's body does not fit
    /// in `limits.max_parsed_bytes` (`budget`) beside those being parsed.
    pub fn parsing_full(budget: u64) -> Self {
        Self::new(
            ErrorCode::TooManyConcurrentRequests,
            format!(
                "canarygate is parsing as much request data as its limit of {budget} bytes \
                 allows (limits.max_parsed_bytes); retry shortly."
            ),
        )
    }

    /// 408 `request_timeout`: the body did not arrive in time. `setting`
    /// names the limit, `millis` its value.
    pub fn body_timeout(setting: &'static str, millis: u64) -> Self {
        Self::new(
            ErrorCode::RequestTimeout,
            format!("The request body did not arrive in time (limits.{setting} = {millis} ms)."),
        )
    }

    /// 429 `too_many_concurrent_requests`.
    pub fn overloaded(limit: usize) -> Self {
        Self::new(
            ErrorCode::TooManyConcurrentRequests,
            format!(
                "canarygate is serving its limit of {limit} concurrent requests \
                 (limits.max_concurrent_requests); retry shortly."
            ),
        )
    }

    /// 500 `internal_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InternalError, message)
    }

    /// 500 `audit_log_unavailable`: the answer is withheld.
    pub fn audit_unavailable() -> Self {
        Self::new(
            ErrorCode::AuditLogUnavailable,
            "canarygate could not record this request in its audit log, so the answer is \
             withheld.",
        )
    }

    /// 502 `canarygate_verification_failed`: the answer failed `verdict` and
    /// the policy withholds it.
    pub fn verification_failed(verdict: &Verdict) -> Self {
        Self {
            failed_checks: verdict.failed_check_names(),
            ..Self::new(ErrorCode::VerificationFailed, verdict.failure_message())
        }
    }

    /// A provider error that is not in the client's format, passed on with
    /// the provider's `status`.
    pub fn provider_http(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            ..Self::new(ErrorCode::UpstreamHttpError, message)
        }
    }

    /// The HTTP status to answer with.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code.code(),
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

/// The message of `error` followed by each of its sources, `: `-separated, so
/// that a TLS failure deep in the stack ("invalid peer certificate: UnknownIssuer")
/// reaches the client and the log.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_statuses_match_their_type() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert!(seen.insert(code.code()), "{code:?} reuses {}", code.code());
            let status = code.status();
            match code.kind() {
                "invalid_request_error" => assert!(status.is_client_error(), "{code:?}"),
                "rate_limit_error" => assert_eq!(status, StatusCode::TOO_MANY_REQUESTS),
                "upstream_error" => assert!(status.is_server_error(), "{code:?}"),
                "server_error" => assert!(status.is_server_error(), "{code:?}"),
                "canarygate_verification_failed" => assert_eq!(code, ErrorCode::VerificationFailed),
                other => panic!("{code:?}: unexpected type {other}"),
            }
        }
    }

    /// The README's error table names every code canarygate can send, with
    /// the status it is sent with.
    #[test]
    fn the_readme_error_table_lists_every_code() {
        let readme = include_str!("../../README.md");
        let table: Vec<&str> = readme
            .lines()
            .skip_while(|line| !line.starts_with("| status | code | when |"))
            .take_while(|line| line.starts_with('|'))
            .collect();
        assert!(table.len() > 2, "no error table in the README");
        for code in ErrorCode::ALL {
            let wire = format!("`{}`", code.code());
            let status = match code {
                ErrorCode::UpstreamHttpError => "provider's".to_owned(),
                _ => code.status().as_u16().to_string(),
            };
            assert!(
                table.iter().any(|row| {
                    let mut cells = row.split('|').map(str::trim).skip(1);
                    cells.next() == Some(status.as_str())
                        && cells.next().is_some_and(|codes| codes.contains(&wire))
                }),
                "the README's error table has no row `| {status} | ... {wire} ... |`"
            );
        }
    }
}
