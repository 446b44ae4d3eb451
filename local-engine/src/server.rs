//! OpenAI-compatible HTTP front of the engine (`canarygate engine serve`).
//!
//! `POST /v1/chat/completions` (streamed as SSE or not), `GET /v1/models`, `GET /health`.
//! Errors use OpenAI's shape `{"error": {"message", "type", "code"}}`; a request over the
//! context window gets HTTP 400 with code `context_length_exceeded`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
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
        .with_state(state);
    axum::serve(listener, app).await
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

async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
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
