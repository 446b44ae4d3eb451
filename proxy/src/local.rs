//! The bundled local engine inside the proxy.
//!
//! `serve` starts it from `[local]` (see [`start`]). A request is served here
//! instead of upstream when the provider cannot be trusted with its context
//! (the preflight), when the provider's answer failed verification under
//! `verify.action = "fallback"` before anything reached the client, or, with
//! `local.on_upstream_unavailable`, when the provider cannot be reached.
//! Local answers are not canary-checked: the engine's KV pool cannot leak
//! (see the `canarygate-engine` crate). They carry `x-canarygate-served-by:
//! local` and the route's `local_model` name, and are recorded with route
//! `local` and action `fallback`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use canarygate_engine::openai::{ChatError, start_chat};
use canarygate_engine::{Engine, EngineConfig, EngineHandle};
use canarygate_policies::local_config::LocalConfig;
use tokio::sync::OwnedSemaphorePermit;

use crate::audit::Route;
use crate::error::ApiError;
use crate::request::ChatRequest;
use crate::server::{Exchange, Served, StreamBody};
use crate::trail::Trail;

/// Response header naming who answered: `upstream` or `local`.
pub const SERVED_BY_HEADER: &str = "x-canarygate-served-by";

/// Response header saying why a request was served locally.
pub const LOCAL_REASON_HEADER: &str = "x-canarygate-local-reason";

/// Name of the local engine where a provider name is expected (audit, errors).
pub const LOCAL_PROVIDER: &str = "local";

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

/// The running engine and what `serve` reports about it.
pub struct LocalEngine {
    handle: Arc<EngineHandle>,
}

impl LocalEngine {
    /// The context window the engine serves, in tokens of its own tokenizer.
    pub fn context_window(&self) -> usize {
        self.handle.context_window()
    }

    /// KV pool capacity, in tokens.
    pub fn pool_tokens(&self) -> usize {
        self.handle.capacity().pool_tokens
    }
}

/// Starts the engine `[local]` describes; `Ok(None)` when no model is
/// configured. Blocking: it loads the weights.
pub fn start(config: &LocalConfig) -> Result<Option<LocalEngine>, String> {
    let Some(model_dir) = config.model_dir() else {
        return Ok(None);
    };
    let mut engine = EngineConfig::new(model_dir);
    engine.kv_budget_bytes =
        usize::try_from(config.kv_budget_mib.get_ref().saturating_mul(1 << 20))
            .unwrap_or(usize::MAX);
    engine.kv_margin = *config.kv_margin.get_ref();
    engine.max_context = config
        .max_context_tokens
        .map(|tokens| usize::try_from(tokens).unwrap_or(usize::MAX));
    engine.max_batch = *config.max_batch.get_ref();
    let handle = Engine::start(engine)
        .map_err(|error| format!("[local] engine with model {model_dir}: {error}"))?;
    Ok(Some(LocalEngine {
        handle: Arc::new(handle),
    }))
}

/// Serves `request` (the client's own body, without canaries) from the local
/// engine, reporting `model`. `Err` when no engine is running or the engine
/// refuses the request.
pub(crate) async fn serve(
    exchange: &Exchange<'_>,
    request: &ChatRequest,
    model: &str,
    reason: LocalReason,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Served, ApiError> {
    let engine = exchange.state.local.as_ref().ok_or_else(|| {
        ApiError::bad_gateway(
            "local_engine_unavailable",
            "No local engine is configured ([local] model_dir), so this request cannot be \
             served locally.",
        )
    })?;
    tracing::info!(
        request_id = %exchange.request_id,
        reason = reason.as_str(),
        "serving from the local engine"
    );
    exchange.state.metrics.count_local(reason.as_str());
    trail.route = Route::Local;
    let call = start_chat(&engine.handle, &request.body, model).map_err(api_error)?;
    trail.prompt_tokens_provider = Some(call.prompt_tokens() as u64);
    if call.is_stream() {
        let permit = permit
            .take()
            .ok_or_else(|| ApiError::internal("the request's concurrency slot is gone"))?;
        let relay = crate::relay::relay_local(call.into_sse(), local_idle_timeout(), permit);
        let mut head = exchange.event_stream_response(Body::empty(), None);
        mark(head.headers_mut(), reason);
        return Ok(Served::Stream(head, StreamBody::Plain(Box::new(relay))));
    }
    let answer = call.complete().await.map_err(api_error)?;
    let mut response = exchange.json_response(StatusCode::OK, Body::from(answer.to_string()), None);
    mark(response.headers_mut(), reason);
    Ok(Served::Whole(response))
}

/// The engine is in this process: a silence this long means it is stuck.
fn local_idle_timeout() -> Duration {
    Duration::from_secs(600)
}

fn mark(headers: &mut axum::http::HeaderMap, reason: LocalReason) {
    headers.insert(
        HeaderName::from_static(SERVED_BY_HEADER),
        HeaderValue::from_static("local"),
    );
    headers.insert(
        HeaderName::from_static(LOCAL_REASON_HEADER),
        HeaderValue::from_static(reason.as_str()),
    );
}

fn api_error(error: ChatError) -> ApiError {
    ApiError {
        status: StatusCode::from_u16(error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        message: format!("Local engine: {}", error.message),
        kind: error.kind,
        code: error.code.unwrap_or("local_engine_error"),
        param: error.param,
    }
}
