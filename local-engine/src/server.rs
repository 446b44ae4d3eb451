//! OpenAI-compatible HTTP front of the engine (`canarygate engine serve`).
//!
//! `POST /v1/chat/completions` (streamed as SSE or not), `GET /v1/models`, `GET /health`.
//! Errors use OpenAI's shape `{"error": {"message", "type", "code"}}`; a request over the
//! context window gets HTTP 400 with code `context_length_exceeded`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{AdmissionError, ChatMessage, EngineHandle, Event, GenerationRequest, SamplingParams};

#[derive(Clone)]
struct AppState {
    engine: Arc<EngineHandle>,
    model: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    seed: Option<u64>,
    stop: Option<Stop>,
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

fn error(status: StatusCode, kind: &str, code: Option<&str>, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": code}});
    (status, axum::Json(body)).into_response()
}

fn admission_error(e: AdmissionError) -> Response {
    match e {
        AdmissionError::ContextLengthExceeded { .. } => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            e.to_string(),
        ),
        AdmissionError::Invalid(_) => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            e.to_string(),
        ),
        AdmissionError::Unavailable => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            None,
            e.to_string(),
        ),
    }
}

async fn models(State(state): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": state.model, "object": "model", "owned_by": "canarygate-local",
                  "context_window": state.engine.context_window()}],
    }))
    .into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    let request: ChatRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                format!("invalid JSON body: {e}"),
            );
        }
    };
    let prompt = match state.engine.chat_prompt(&request.messages) {
        Ok(p) => p,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                e.to_string(),
            );
        }
    };
    let defaults = SamplingParams::default();
    let generation = GenerationRequest {
        prompt,
        max_tokens: request.max_completion_tokens.or(request.max_tokens),
        sampling: SamplingParams {
            temperature: request.temperature.unwrap_or(defaults.temperature),
            top_p: request.top_p.unwrap_or(defaults.top_p),
            top_k: request.top_k.unwrap_or(defaults.top_k),
            seed: request.seed.unwrap_or_else(now),
        },
        stop: match request.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        },
        return_logits: false,
    };
    let generation = match state.engine.submit(generation) {
        Ok(g) => g,
        Err(e) => return admission_error(e),
    };
    let id = format!("chatcmpl-local-{}", generation.id());
    let created = now();
    if !request.stream {
        let result = tokio::task::spawn_blocking(move || generation.wait()).await;
        return match result {
            Ok(Ok(c)) => axum::Json(json!({
                "id": id, "object": "chat.completion", "created": created, "model": state.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason.as_str()}],
                "usage": {"prompt_tokens": c.usage.prompt_tokens,
                          "completion_tokens": c.usage.completion_tokens,
                          "total_tokens": c.usage.prompt_tokens + c.usage.completion_tokens},
            }))
            .into_response(),
            Ok(Err(e)) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                Some("engine_error"),
                e.to_string(),
            ),
            Err(e) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                e.to_string(),
            ),
        };
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let model = state.model.clone();
    tokio::task::spawn_blocking(move || {
        let chunk = |delta: Value, finish: Option<&str>, usage: Option<Value>| {
            let mut c = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
            if let Some(u) = usage {
                c["usage"] = u;
            }
            Bytes::from(format!("data: {c}\n\n"))
        };
        if tx
            .blocking_send(chunk(
                json!({"role": "assistant", "content": ""}),
                None,
                None,
            ))
            .is_err()
        {
            return;
        }
        for event in generation {
            let bytes = match event {
                Event::Token { text, .. } if text.is_empty() => continue,
                Event::Token { text, .. } => chunk(json!({"content": text}), None, None),
                Event::Done {
                    finish_reason,
                    usage,
                } => {
                    let usage = json!({"prompt_tokens": usage.prompt_tokens,
                        "completion_tokens": usage.completion_tokens,
                        "total_tokens": usage.prompt_tokens + usage.completion_tokens});
                    let last = chunk(json!({}), Some(finish_reason.as_str()), Some(usage));
                    let _ = tx.blocking_send(last);
                    let _ = tx.blocking_send(Bytes::from_static(b"data: [DONE]\n\n"));
                    return;
                }
                Event::Failed(e) => {
                    // No [DONE]: the stream ends with the error so clients cannot mistake it
                    // for a complete answer.
                    let body = json!({"error": {"message": e.to_string(), "type": "server_error", "code": "engine_error"}});
                    let _ = tx.blocking_send(Bytes::from(format!("data: {body}\n\n")));
                    return;
                }
            };
            if tx.blocking_send(bytes).is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                e.to_string(),
            )
        })
}
