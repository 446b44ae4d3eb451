//! The local path: the request answered by the bundled engine instead of
//! the provider.
//!
//! The pipeline sends a request here when the provider cannot be trusted
//! with its context (the preflight), when the provider's answer failed
//! verification under `verify.action = "fallback"` before anything reached
//! the client, or, with `local.on_upstream_unavailable`, when the provider
//! cannot be reached. Local answers are not canary-checked: the engine's KV
//! pool cannot leak (see the `canarygate-engine` crate). They carry
//! `x-canarygate-served-by: local` and the route's `local_model` name, and
//! are recorded with route `local` (action `fallback`).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use canarygate_engine::openai::{ChatError, ChatFailure, start_chat};
use canarygate_policies::config::ProviderApi;
use canarygate_policies::sse::SseParser;
use futures_util::{Stream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;

use crate::body::{PendingBody, Served};
use crate::context::{RequestContext, SERVED_BY_HEADER};
use crate::error::{ApiError, ErrorCode};
use crate::relay::Relay;
use crate::trail::Trail;
use crate::wire::{ClientRequest, LocalStream, WireFormat};

/// Response header saying why a request was served locally.
pub const LOCAL_REASON_HEADER: &str = "x-canarygate-local-reason";

/// Name of the local engine where a provider name is expected (logs, errors).
const LOCAL_PROVIDER: &str = "local";

/// The engine is in this process: a silence this long means it is stuck.
const LOCAL_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Why a request is served by the local engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalReason {
    /// Its prompt plus `max_tokens` exceed the provider's trusted limit.
    UntrustedContext,
    /// The provider's answer failed verification (`action = "fallback"`).
    VerificationFailed,
    /// The provider could not be reached, answered 5xx, or timed out.
    UpstreamUnavailable,
}

impl LocalReason {
    /// Value of [`LOCAL_REASON_HEADER`].
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UntrustedContext => "untrusted_context",
            Self::VerificationFailed => "verification_failed",
            Self::UpstreamUnavailable => "upstream_unavailable",
        }
    }
}

/// Serves `request` (the client's own body, without canaries) from the local
/// engine, reporting the route's local model name. `Err` when no engine is
/// running or the engine refuses the request.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    request: &ClientRequest,
    reason: LocalReason,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    // The provider's headers (its request id, rate limits) are not about
    // this answer.
    context.forget_provider_headers();
    let state = context.state;
    let engine = state.local.as_ref().ok_or_else(|| {
        ApiError::new(
            ErrorCode::LocalEngineUnavailable,
            "No local engine is configured ([local] model_dir), so this request cannot be \
             served locally.",
        )
    })?;
    tracing::info!(
        request_id = %context.request_id,
        reason = reason.as_str(),
        "serving from the local engine"
    );
    state.metrics.count_local(reason.as_str());
    trail.served_locally();
    // The engine speaks Chat Completions; other formats are translated.
    let chat = W::local_request(&request.body)?;
    let call = start_chat(engine.handle(), &chat, context.local_model).map_err(api_error::<W>)?;
    let prompt_tokens = call.prompt_tokens() as u64;
    trail.prompt_tokens_provider(Some(prompt_tokens));
    if call.is_stream() {
        let permit = permit
            .take()
            .ok_or_else(|| ApiError::internal("the request's concurrency slot is gone"))?;
        let relay = Relay::<W>::local(
            translated(
                call.into_sse(),
                W::local_stream(&request.body, prompt_tokens),
            ),
            LOCAL_PROVIDER.to_owned(),
            LOCAL_IDLE_TIMEOUT,
            permit,
        );
        let mut head = context.event_stream_response(None);
        mark::<W>(head.headers_mut(), reason, &context.request_id);
        return Ok(Served::Stream(head, PendingBody::new(relay)));
    }
    let answer = W::local_answer(
        call.complete().await.map_err(api_error::<W>)?,
        &request.body,
    );
    let mut response = context.json_response(StatusCode::OK, Body::from(answer.to_string()), None);
    mark::<W>(response.headers_mut(), reason, &context.request_id);
    Ok(Served::Whole(response))
}

/// The engine's Chat Completions `stream` as events of the client's format.
fn translated(
    stream: impl Stream<Item = Bytes> + Send + 'static,
    mut local: impl LocalStream,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    stream.map(move |bytes| {
        parser.feed(&bytes, &mut events);
        let mut out = Vec::new();
        for event in events.drain(..) {
            local.translate(&event, &mut out);
        }
        Bytes::from(out)
    })
}

/// Marks a local answer: served by `local`, for `reason`, and under
/// canarygate's `request_id` in the header the API's SDK reads its request
/// id from (`x-request-id`, Anthropic's `request-id`), as the provider's
/// answers carry the provider's.
fn mark<W: WireFormat>(headers: &mut HeaderMap, reason: LocalReason, request_id: &str) {
    let name = match W::API {
        ProviderApi::Openai => "x-request-id",
        ProviderApi::Anthropic => "request-id",
    };
    if let Ok(value) = HeaderValue::from_str(request_id) {
        headers.insert(HeaderName::from_static(name), value);
    }
    headers.insert(
        HeaderName::from_static(SERVED_BY_HEADER),
        HeaderValue::from_static("local"),
    );
    headers.insert(
        HeaderName::from_static(LOCAL_REASON_HEADER),
        HeaderValue::from_static(reason.as_str()),
    );
}

/// The engine's refusal as canarygate's error in format `W`: the engine's
/// `messages` and `max_tokens` (its Chat request's prompt and limit) are
/// `W`'s prompt and limit fields, in `param` and in the message.
fn api_error<W: WireFormat>(error: ChatError) -> ApiError {
    let code = match error.failure {
        ChatFailure::Invalid => ErrorCode::LocalEngineRejected,
        ChatFailure::ContextLengthExceeded => ErrorCode::ContextLengthExceeded,
        ChatFailure::Unavailable => ErrorCode::LocalEngineStopping,
        ChatFailure::Failed => ErrorCode::LocalEngineFailed,
    };
    let param = match error.param {
        Some("messages") => Some(W::PROMPT_PARAM),
        Some("max_tokens") => Some(W::LIMIT_PARAM),
        param => param,
    };
    let message = match (error.param, param) {
        (Some(engine), Some(own)) if engine != own => error
            .message
            .replace(&format!("`{engine}`"), &format!("`{own}`")),
        _ => error.message,
    };
    let mut api_error = ApiError::new(code, format!("Local engine: {message}"));
    api_error.param = param;
    api_error
}
