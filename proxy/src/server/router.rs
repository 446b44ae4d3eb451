//! Routes, the middleware every response goes through, and the handlers:
//! thin, each hands its request to admission and the pipeline.

use std::sync::Arc;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, Uri, Version, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use canarygate_policies::registry_config::OnUnavailable;
use serde_json::json;

use super::admission::admit;
use super::models::{anthropic_client, described, list_models};
use crate::body::{Served, deliver_whole};
use crate::context::{REQUEST_ID_HEADER, error_response};
use crate::error::{ApiError, ErrorCode};
use crate::metrics::Metrics;
use crate::paths::passthrough::Stored;
use crate::pipeline;
use crate::state::AppState;
use crate::trail::{PendingTrail, Trail};
use crate::wire::WireFormat;
use crate::wire::chat::Chat;
use crate::wire::completions::Completions;
use crate::wire::messages::Messages;
use crate::wire::responses::Responses;

/// Request id of the current request, set by the middleware.
#[derive(Clone)]
pub struct RequestId(pub Arc<str>);

/// The `Allow` header of an endpoint answering POST.
const POST_ONLY: &str = "POST";
/// The `Allow` header of an endpoint answering GET (HEAD comes with it).
const GET_ONLY: &str = "GET, HEAD";

/// The proxy's routes. An unknown path is 404 `unknown_url`, a known one
/// with another method 405 `method_not_allowed` with `Allow`: both in the
/// shape of the API the path belongs to (Anthropic's under `/v1/messages`,
/// OpenAI's elsewhere), like every error.
pub fn router(state: Arc<AppState>) -> Router {
    let metrics = state.metrics.clone();
    Router::new()
        .route(
            "/v1/chat/completions",
            only::<Chat>(
                "GET, HEAD, POST",
                post(serve_endpoint::<Chat>).get(stored_completion),
            ),
        )
        .route(
            "/v1/chat/completions/{id}",
            only::<Chat>(
                "GET, HEAD, POST, DELETE",
                get(stored_completion)
                    .post(stored_completion)
                    .delete(stored_completion),
            ),
        )
        .route(
            "/v1/chat/completions/{id}/messages",
            only::<Chat>(GET_ONLY, get(stored_completion)),
        )
        .route(
            "/v1/responses",
            only::<Chat>(POST_ONLY, post(serve_endpoint::<Responses>)),
        )
        .route("/v1/embeddings", only::<Chat>(POST_ONLY, post(embeddings)))
        .route(
            "/v1/responses/{id}",
            only::<Chat>(
                "GET, HEAD, DELETE",
                get(stored_response).delete(stored_response),
            ),
        )
        .route(
            "/v1/responses/{id}/input_items",
            only::<Chat>(GET_ONLY, get(stored_response)),
        )
        .route(
            "/v1/responses/{id}/cancel",
            only::<Chat>(POST_ONLY, post(stored_response)),
        )
        .route(
            "/v1/completions",
            only::<Chat>(POST_ONLY, post(serve_endpoint::<Completions>)),
        )
        .route("/v1/models", only::<Chat>(GET_ONLY, get(list_models)))
        .route(
            "/v1/models/{id}",
            only::<Chat>(GET_ONLY, get(retrieve_model)),
        )
        .route("/healthz", only::<Chat>(GET_ONLY, get(healthz)))
        .route("/metrics", only::<Chat>(GET_ONLY, get(render_metrics)))
        .route(
            "/v1/messages",
            only::<Messages>(POST_ONLY, post(serve_endpoint::<Messages>)),
        )
        .route(
            "/v1/messages/count_tokens",
            only::<Messages>(POST_ONLY, post(count_tokens)),
        )
        .fallback(passthrough_or_unknown)
        .layer(middleware::from_fn_with_state(metrics, tag_and_count))
        .with_state(state)
}

/// `methods` with every other method answered 405 in `W`'s error shape,
/// naming `allow`.
fn only<W: WireFormat>(
    allow: &'static str,
    methods: MethodRouter<Arc<AppState>>,
) -> MethodRouter<Arc<AppState>> {
    methods.fallback(move |method: Method, uri: Uri| async move {
        let mut response = error_response::<W>(&ApiError::new(
            ErrorCode::MethodNotAllowed,
            format!(
                "{method} is not allowed on {}: it answers {allow}.",
                uri.path()
            ),
        ));
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        response
    })
}

/// Gives every request an id (request extension + response header) and counts
/// every response by endpoint and status.
async fn tag_and_count(
    State(metrics): State<Arc<Metrics>>,
    mut request: Request,
    next: Next,
) -> Response {
    let id: Arc<str> = format!("cg-{}", uuid::Uuid::now_v7().simple()).into();
    let route = match request
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some("/v1/chat/completions") if request.method() != Method::POST => STORED_COMPLETIONS,
        Some("/v1/chat/completions") => Chat::ENDPOINT,
        Some("/v1/chat/completions/{id}" | "/v1/chat/completions/{id}/messages") => {
            STORED_COMPLETIONS
        }
        Some("/v1/completions") => Completions::ENDPOINT,
        Some("/v1/embeddings") => "embeddings",
        Some(
            "/v1/responses/{id}" | "/v1/responses/{id}/input_items" | "/v1/responses/{id}/cancel",
        ) => STORED_RESPONSES,
        None if request.uri().path().starts_with("/v1/") => PASSTHROUGH,
        Some("/v1/responses") => Responses::ENDPOINT,
        Some("/v1/messages") => Messages::ENDPOINT,
        Some("/v1/messages/count_tokens") => COUNT_TOKENS,
        Some("/v1/models") => "models",
        Some("/healthz") => "healthz",
        Some("/metrics") => "metrics",
        _ => "unknown",
    };
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    metrics.count_request(route, response.status().as_u16());
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// Endpoint name of the stored-response endpoints of the Responses API.
const STORED_RESPONSES: &str = "responses_stored";

/// Endpoint name of the stored-completion endpoints of Chat Completions.
const STORED_COMPLETIONS: &str = "chat_completions_stored";

/// Endpoint name of a model's description, asked of a provider.
const MODEL: &str = "models_retrieve";

/// Endpoint name of Anthropic's token count.
const COUNT_TOKENS: &str = "messages_count_tokens";

/// Endpoint name of the `[endpoints] passthrough` paths.
const PASSTHROUGH: &str = "passthrough";

/// A request of an endpoint without answer text to verify, in wire format
/// `W`'s API: admitted, forwarded, recorded.
async fn forward<W: WireFormat>(
    state: Arc<AppState>,
    request_id: RequestId,
    request: Request,
    endpoint: &'static str,
    blockable: bool,
    needs_model: bool,
) -> Response {
    let (parts, body) = request.into_parts();
    let mut trail = PendingTrail::new(Trail::start(
        state.audit.clone(),
        &request_id.0,
        state.metrics.clone(),
    ));
    let path = parts.uri.path();
    if !is_plain_path(path) {
        return error_response::<W>(&ApiError::new(
            ErrorCode::UnknownUrl,
            "A forwarded path must be plain: no `.` or `..` segments, no escaped dots or \
             slashes, no backslashes.",
        ));
    }
    let upstream_endpoint = path.trim_start_matches("/v1/");
    let served = match admit(&state, request_id.0.clone(), &parts, body, trail.get()).await {
        Ok(admitted) => {
            let passthrough = pipeline::Passthrough {
                endpoint,
                blockable,
                needs_model,
                method: parts.method.clone(),
                upstream_endpoint,
                stored: match endpoint {
                    STORED_RESPONSES => Some(Stored::Responses),
                    STORED_COMPLETIONS => Some(Stored::ChatCompletions),
                    _ => None,
                },
            };
            pipeline::pass_through::<W>(&state, admitted, passthrough, trail.get()).await
        }
        Err(error) => Err(error),
    };
    let response = served.unwrap_or_else(|error| {
        tracing::debug!(request_id = %request_id.0, "{error}");
        error_response::<W>(&error)
    });
    deliver_whole::<W>(trail.take(), response).await
}

/// Whether `path` means what it says once joined onto a provider's base
/// URL: `..` there would climb out of the endpoint the policy allows (to
/// `chat/completions`, unverified).
fn is_plain_path(path: &str) -> bool {
    let lowered = path.to_ascii_lowercase();
    !["%2e", "%2f", "%5c", "\\"]
        .iter()
        .any(|bad| lowered.contains(bad))
        && path
            .trim_end_matches('/')
            .split('/')
            .skip(1)
            .all(|segment| !matches!(segment, "" | "." | ".."))
}

/// `POST /v1/embeddings`: forwarded, recorded `unverifiable`.
async fn embeddings(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    request: Request,
) -> Response {
    forward::<Chat>(state, request_id, request, "embeddings", true, true).await
}

/// The Responses API's stored responses (`GET`/`DELETE /v1/responses/{id}`,
/// its `input_items`, `cancel`): forwarded, and answered as the provider
/// stored them less canarygate's blocks and echo.
async fn stored_response(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    request: Request,
) -> Response {
    forward::<Chat>(state, request_id, request, STORED_RESPONSES, false, false).await
}

/// Chat Completions' stored completions (`GET /v1/chat/completions`,
/// `GET`/`POST`/`DELETE /v1/chat/completions/{id}`, its `messages`):
/// forwarded, and answered as the provider stored them less canarygate's
/// blocks and echo.
async fn stored_completion(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    request: Request,
) -> Response {
    forward::<Chat>(state, request_id, request, STORED_COMPLETIONS, false, false).await
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`), in the caller's
/// API as for [`list_models`]: a model the policy routes by name is
/// described here; any other is asked of the wildcard route's provider, or
/// is 404 `model_not_found` when there is none.
async fn retrieve_model(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    axum::extract::Path(id): axum::extract::Path<String>,
    request: Request,
) -> Response {
    if anthropic_client(request.headers()) {
        match described::<Messages>(&state, &id) {
            Some(response) => response,
            None => forward::<Messages>(state, request_id, request, MODEL, false, false).await,
        }
    } else {
        match described::<Chat>(&state, &id) {
            Some(response) => response,
            None => forward::<Chat>(state, request_id, request, MODEL, false, false).await,
        }
    }
}

/// `POST /v1/messages/count_tokens`: forwarded to the Messages provider.
async fn count_tokens(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    request: Request,
) -> Response {
    forward::<Messages>(state, request_id, request, COUNT_TOKENS, false, true).await
}

/// Any other path: forwarded when `[endpoints] passthrough` lists it, else
/// 404 `unknown_url` (in Anthropic's shape under `/v1/messages/`).
async fn passthrough_or_unknown(
    State(state): State<Arc<AppState>>,
    request_id: Option<axum::Extension<RequestId>>,
    request: Request,
) -> Response {
    // Anthropic's paths (`/v1/messages/batches`), or an Anthropic client's,
    // go to an Anthropic provider, with its headers and errors.
    let anthropic =
        request.uri().path().starts_with("/v1/messages/") || anthropic_client(request.headers());
    if let Some(axum::Extension(request_id)) = request_id
        && state.policy.endpoints.passes_through(request.uri().path())
    {
        return if anthropic {
            forward::<Messages>(state, request_id, request, PASSTHROUGH, true, false).await
        } else {
            forward::<Chat>(state, request_id, request, PASSTHROUGH, true, false).await
        };
    }
    let error = ApiError::new(
        ErrorCode::UnknownUrl,
        format!(
            "Unknown endpoint {}: canarygate serves POST /v1/chat/completions, /v1/responses, \
             /v1/messages, /v1/completions and /v1/embeddings, GET /v1/models, GET /healthz, \
             GET /metrics, and the paths its policy lists in [endpoints] passthrough.",
            request.uri().path()
        ),
    );
    if anthropic {
        error_response::<Messages>(&error)
    } else {
        error_response::<Chat>(&error)
    }
}

/// `GET /healthz`: `ok`, or, while the shared canary registry cannot be
/// reached, `degraded` (200: requests are served, local-only detection) or
/// `unavailable` (503, so a load balancer drains the instance: the policy
/// fails closed and requests are refused).
async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    let config = &state.policy.registry;
    let Some(health) = state.registry.shared_health() else {
        return axum::Json(json!({"status": "ok", "registry": {"backend": "memory"}}))
            .into_response();
    };
    let (status, code) = match (health.up, config.on_unavailable) {
        (true, _) => ("ok", axum::http::StatusCode::OK),
        (false, OnUnavailable::Degrade) => ("degraded", axum::http::StatusCode::OK),
        (false, OnUnavailable::FailClosed) => {
            ("unavailable", axum::http::StatusCode::SERVICE_UNAVAILABLE)
        }
    };
    let body = json!({
        "status": status,
        "registry": {
            "backend": "redis",
            "up": health.up,
            "on_unavailable": config.on_unavailable.name(),
            "error": health.error,
        },
    });
    (code, axum::Json(body)).into_response()
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    state
        .metrics
        .set_audit_background_failures(state.audit.background_failures());
    state
        .metrics
        .set_audit_cache_bytes(state.audit.cache_bytes());
    state
        .metrics
        .set_canaries_in_memory(state.registry.held_in_memory());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

/// One request of an endpoint in wire format `W`: admitted, served by the
/// pipeline, recorded.
async fn serve_endpoint<W: WireFormat>(
    State(state): State<Arc<AppState>>,
    axum::Extension(request_id): axum::Extension<RequestId>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    // Recorded even when the client leaves before the answer (the guard's Drop).
    let mut trail = PendingTrail::new(Trail::start(
        state.audit.clone(),
        &request_id.0,
        state.metrics.clone(),
    ));
    let served = match admit(&state, request_id.0.clone(), &parts, body, trail.get()).await {
        Ok(admitted) => pipeline::serve::<W>(&state, admitted, trail.get()).await,
        Err(error) => Err(error),
    };
    let response = match served {
        Ok(Served::Stream(mut head, body)) => {
            *head.body_mut() = body.into_body(trail.take());
            return head;
        }
        Ok(Served::Whole(response)) => response,
        Err(error) => {
            if error.status().is_server_error() {
                tracing::warn!(request_id = %request_id.0, "{error}");
            } else {
                tracing::debug!(request_id = %request_id.0, "{error}");
            }
            let mut response = error_response::<W>(&error);
            if error.code == ErrorCode::RequestTimeout && parts.version <= Version::HTTP_11 {
                // The rest of the body may still come: this connection is
                // done (HTTP/2 resets just the stream).
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            response
        }
    };
    deliver_whole::<W>(trail.take(), response).await
}
