//! OpenAI-compatible HTTP front of the engine (`canarygate engine serve`).
//!
//! `POST /v1/chat/completions` (streamed as SSE or not), `GET /v1/models`, `GET /health`.
//! Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; a request over
//! the context window gets HTTP 400 with code `context_length_exceeded`, another path 404
//! `unknown_url`, another method 405 `method_not_allowed`, as OpenAI answers them; a body
//! over 2 MiB 413 `request_too_large`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::EngineHandle;
use crate::openai::{ChatError, ChatFailure, start_chat};

#[derive(Clone)]
struct AppState {
    engine: Arc<EngineHandle>,
    model: String,
}

/// Serves the engine on `listener` until the listener fails. `model` is the name reported in
/// responses.
pub async fn serve(
    engine: Arc<EngineHandle>,
    model: String,
    listener: tokio::net::TcpListener,
) -> std::io::Result<()> {
    let state = AppState { engine, model };
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .fallback(unknown_url)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state);
    axum::serve(listener, app).await
}

/// An error of OpenAI's shape with no request field at fault.
fn plain_error(status: StatusCode, code: &str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error",
                                "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}

async fn unknown_url(method: Method, uri: Uri) -> Response {
    plain_error(
        StatusCode::NOT_FOUND,
        "unknown_url",
        format!("Unknown request URL: {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    plain_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

fn error_response(error: &ChatError) -> Response {
    let status = StatusCode::from_u16(error.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, axum::Json(error.body())).into_response()
}

async fn models(State(state): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": state.model, "object": "model", "owned_by": "canarygate-local",
                  "context_window": state.engine.context_window()}],
    }))
    .into_response()
}

async fn chat_completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    // A body that could not be read (over axum's 2 MiB default) is refused
    // in OpenAI's shape, with the status axum gives it.
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            let status = rejection.status();
            let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "request_too_large"
            } else {
                "invalid_body"
            };
            return plain_error(status, code, rejection.body_text());
        }
    };
    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            return error_response(&ChatError::invalid(None, format!("invalid JSON body: {e}")));
        }
    };
    let call = match start_chat(&state.engine, &request, &state.model) {
        Ok(call) => call,
        Err(error) => return error_response(&error),
    };
    if !call.is_stream() {
        return match call.complete().await {
            Ok(answer) => axum::Json(answer).into_response(),
            Err(error) => error_response(&error),
        };
    }
    let stream = call.into_sse().map(Ok::<_, Infallible>);
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| {
            error_response(&ChatError {
                failure: ChatFailure::Failed,
                param: None,
                message: e.to_string(),
            })
        })
}
